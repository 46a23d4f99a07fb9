"""What client and service share: draft trees, errors, names, bearer credentials and the backoff policy.

The generated gRPC code lives in ``drafter_service.api.drafter.v1`` (``drafter_pb2``, ``drafter_pb2_grpc``) and the
frozen-table wire format in ``drafter_service.api.frozen_wire`` (it needs ``store``): import those directly.
"""

from drafter_service.api.backoff import BackoffClock, ExponentialBackoff
from drafter_service.api.credentials import bearer_token, check_token, read_secret
from drafter_service.api.errors import (
                                        AlreadyExists,
                                        DrafterError,
                                        InvalidArgument,
                                        NotFound,
                                        PermissionDenied,
                                        ResourceExhausted,
                                        Unauthenticated,
                                        Unavailable,
)
from drafter_service.api.names import DEFAULT_NAMESPACE, check_name
from drafter_service.api.tree import EMPTY_TREE, DraftTree, accept_greedy, chain, merge_trees

__all__ = ["AlreadyExists", "BackoffClock", "DEFAULT_NAMESPACE", "DraftTree", "DrafterError", "EMPTY_TREE",
           "ExponentialBackoff", "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted",
           "Unauthenticated", "Unavailable", "accept_greedy", "bearer_token", "chain", "check_name", "check_token",
           "merge_trees", "read_secret"]
