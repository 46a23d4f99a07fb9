"""Bringing completed requests in: warm from request logs, corpus reading and frozen-table builds."""
