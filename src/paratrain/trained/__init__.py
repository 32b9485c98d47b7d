"""A trained run used offline, after (or between) training: its model loaded in one
process to sample and score (`run_model`), scored on a mesh of workers for a model too
large for one (`mesh_eval`), exported as one safetensors file (`safetensors_file`) or a
Hugging Face directory and imported from one (`hf_directory`).

May import: config, models, data, checkpoint, train (the engine, to score on a mesh),
parallel, comm, mesh. Imported by: commands.
"""
