"""meshrl: RL post-training of language models on Monarch actors, with vLLM and torchtitan."""
