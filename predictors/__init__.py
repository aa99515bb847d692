"""Offline predictor training (torch): ProMoE's per-layer MLPs, exported to the numpy ``.npz`` of
``ggmoe.predict.mlp`` that the runtime loads without torch.

- ``predictors.mlp``: the two-layer MLP and the training loop of one net (early stopping, seeded);
- ``predictors.train``: which nets to train from a trace, the data, the loop over nets, the export.

Run it as ``ggmoe train-predictor TRACES -o PRED.npz`` (needs the ``[train]`` extra).
"""
