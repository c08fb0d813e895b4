"""Sparse dictionaries (SAEs and transcoders) read from, trained for and spliced into a causal language model."""
