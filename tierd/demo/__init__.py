"""``tierd demo``: fine-tune a small GPT-2 with every tensor in tierd's tiers."""
