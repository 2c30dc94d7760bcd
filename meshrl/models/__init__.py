"""The models: torchtitan's model code for each supported family (`families`), any other Hugging Face
architecture through torchtitan's transformers backend (`hf_backend`), and checkpoints found,
converted and tokenized (`model`). The trainer and the generators build on it; it imports nothing
of the controller."""
