"""One worker's training run: from a checked configuration to a trained, recorded model.

worker.py joins the process group and builds the mesh; loop.py (or async_loop.py for the
parameter server) runs the steps: build.py makes this rank's engine (engine.py: the model,
made parallel), data/ samples the batches, step.py takes one step through the engine
(clip.py: the one global norm; optim.py: the learning rate), and the loop logs
(metrics.py, progress.py, prediction.py), checkpoints (checkpoint/, run_dir.py,
resume.py, preemption.py), evaluates (microbatch_passes.py), and with --trace writes the pipeline's
timeline (pipeline_trace.py). A finished run's model is used offline by trained/.
"""
