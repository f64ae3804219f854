"""Tenants from the auth file: keys, allowlists, quotas, shared counts, audit log."""
