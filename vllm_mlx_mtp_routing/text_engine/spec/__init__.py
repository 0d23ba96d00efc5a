"""Speculative decoding with the MTP head: the proposer, the verify and its rollback, acceptance, the draft policy."""
