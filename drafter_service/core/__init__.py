"""The drafting core: sessions, the drafter of one namespace, the tree builder and its acceptance model.

``Drafter`` drafts for one token space from every model-free source (the request itself, the suffix index over
stored requests, the dynamic and frozen n-gram tables, repeated prompts); an optional draft model plugs in
through ``ModelDrafts``. Configuration is ``DrafterConfig``; every setting is declared once (``settings``).
"""

from drafter_service.core.acceptance import AcceptanceModel
from drafter_service.core.config import CardSettings, DrafterConfig, DraftModelSpec
from drafter_service.core.drafter import Drafter
from drafter_service.core.model_drafts import ModelDrafts, ModelSession
from drafter_service.core.session import BudgetPolicy, Confirmation, DraftSession

__all__ = ["AcceptanceModel", "BudgetPolicy", "CardSettings", "Confirmation", "DraftModelSpec", "DraftSession",
           "Drafter", "DrafterConfig", "ModelDrafts", "ModelSession"]
