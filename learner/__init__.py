"""Online distillation: replay shards, losses, trainer, publisher."""
