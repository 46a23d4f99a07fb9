"""The service: namespaces and sessions routed per tenant, authorization, and its configuration."""
