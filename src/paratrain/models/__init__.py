"""Plain single-device models, and how they are split (plans.py). No process groups here."""
