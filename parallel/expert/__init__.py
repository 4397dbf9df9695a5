"""The expert dimension: every ``parallel.nn.MoE`` layer's experts sharded over the ``ep`` ranks.

``experts.py`` applies it beside data parallel (and optimizer parallel, pipeline stages);
``semi_auto.py`` runs MoE layers inside a semi-auto (or auto) model on plain local tensors.
"""
