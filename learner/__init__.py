"""Online distillation: replay shards, losses, trainer, publisher.

- :mod:`learner.losses`: forward KL, reverse KL, JSD(beta), TVD over sparse top-K + tail targets
- :mod:`learner.replay`: per-draft replay shards built from the engine's step results
- :mod:`learner.offline`: offline distillation from the target's own generations (``osd train-draft``)
- :mod:`learner.trainer`: the online trainer: rounds, publish gate, versions, checkpoints, rollback
"""
