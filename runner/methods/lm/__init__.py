"""The language-model kit the LM methods (lm_patching, lm_edges, lm_saliency's) share: their base and the batch of
prompt pairs (base.py), the target read from a pair's two runs and its restoration (pairs.py), the corruptions
(corruptions.py), the readout through the unembedding (readout.py), the (pair, position) cells of a padded batch
(cells.py). The site hooks themselves are runner/hooks/sites.py."""
