"""Generation stage: prompts in the store → sampled responses in the store (see ``stage``)."""
