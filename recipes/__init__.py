"""The training recipes (``train.py``: GPT; ``wide_deep.py``: Wide&Deep) and their parts.

A package, so the recipes and their tests import the parts by qualified name
(``from recipes.checkpoint import ...``) and short module names such as ``optim`` or ``metrics``
never shadow another package. The recipes still run as files (``python recipes/train.py``,
``torchrun ... recipes/train.py``): each script then puts the repository root, instead of
``recipes/`` itself, at the head of ``sys.path`` before its imports.
"""
