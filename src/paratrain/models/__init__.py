"""Plain single-device models, and how each is split, as data.

gpt.py is an ordinary PyTorch model that knows no process group; blocks in a ModuleDict. plans.py
holds every fact a strategy needs about it (the TP plan, pipeline cut points, FSDP units,
recompute units) as a `ModelPlan`. train/build.py builds the model and
hands the plan's pieces to the functions of parallel/, which never import a model.
"""
