"""The allocation ledger: the journal of every allocation of both front ends and its states."""
