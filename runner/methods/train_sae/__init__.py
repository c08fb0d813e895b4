"""method=train_sae as library functions, callable on a model and token windows from a notebook (method.py adapts
them to the run loop):

    acts = collect_activations(model, train_ids, "resid_post", 15)           # (N, d): activations.py
    trained = train_dictionary(acts, Training("topk", 2048, k=32))          # training.py
    held = collect_activations(model, held_ids, "resid_post", 15)
    reconstruction(trained.dictionary, held).fvu                             # evaluation.py

`spliced_losses` (evaluation.py) gives the three cross-entropies of windows with the site spliced, through a
`SiteReader` in a hook session; `feature_columns` (features.py) the feature table.
"""

from runner.methods.train_sae.activations import SiteReader, collect_activations
from runner.methods.train_sae.evaluation import Reconstruction, reconstruction, recovered, spliced_losses
from runner.methods.train_sae.features import feature_columns
from runner.methods.train_sae.training import Trained, Training, train_dictionary

__all__ = [
    "Reconstruction",
    "SiteReader",
    "Trained",
    "Training",
    "collect_activations",
    "feature_columns",
    "reconstruction",
    "recovered",
    "spliced_losses",
    "train_dictionary",
]
