"""Domain errors; the gRPC layer maps each to one status code."""


class DrafterError(Exception):
    """Base class of every error a caller can cause."""


class InvalidArgument(DrafterError, ValueError):
    """The request is malformed: bad token ids, sizes, budgets or names."""


class NotFound(DrafterError, KeyError):
    """An unknown session or namespace."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class AlreadyExists(DrafterError):
    """A session id already in use."""


class Unavailable(DrafterError):
    """The service cannot serve the request right now (its storage is unreachable)."""


class ResourceExhausted(DrafterError):
    """A configured limit (sessions, sizes) is reached."""


class Unauthenticated(DrafterError):
    """No credentials, malformed ones, or a token the service does not know."""


class PermissionDenied(DrafterError):
    """Valid credentials that do not grant what was asked for (another tenant's namespace)."""
