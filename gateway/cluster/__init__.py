"""Runs in named, detached Ray actors, one per cluster or application, that every replica
shares: the tenants' ledger, the batch host, stored responses and AICI's tags, and the state
directory they keep (docs/tenancy.md)."""
