"""`paratrain bench model`: our GPT and Llama against transformers' `GPT2LMHeadModel` and
`LlamaForCausalLM`, models someone else wrote, on the same shapes, weights, data and threads.

    peer.py   the transformers twin of our model: its config from ours (models/hf.py),
              scaled-dot-product attention, our weights converted into it
    run.py    the pairs: forward plus backward, and a whole optimizer step, alternating
              which side goes first; the loss checks that void a comparison
"""
