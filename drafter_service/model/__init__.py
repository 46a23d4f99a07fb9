"""Optional draft models: CARD query-and-correct candidate caches, loading and distillation.

Modules: ``card`` (``load_drafts``: a namespace's draft model as the core's ``ModelDrafts``), ``card_cache`` (the
candidate tree a model grows), ``draft_model`` (loading and saving checkpoints), ``distill`` and ``distill_data``
(``drafter distill-draft``). Nothing is imported here: each pulls in torch, which only namespaces with a draft
model need.
"""
