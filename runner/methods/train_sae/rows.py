"""The tables method=train_sae writes, declared beside the code that builds their rows (runner/tables.py), and how the
report shows them (runner/viz/dictionary_report.py). Definitions: evaluation.py (the evaluation), features.py (the
feature table), training.py (the training curve)."""

from __future__ import annotations

import pyarrow as pa

from runner.tables import Presentation, declare

SECTIONS = "runner.viz.dictionary_report"
EVALUATION_TABLE, STEPS_TABLE, FEATURES_TABLE, WINDOWS_TABLE = (
    "train_sae", "train_sae_steps", "train_sae_features", "train_sae_windows"
)  # fmt: skip

EVALUATION = declare(
    EVALUATION_TABLE,  # one row per dictionary: the run's main table
    [
        pa.field("site", pa.string()),  # resid_pre, resid_mid, resid_post, attn_out, mlp_out
        pa.field("layer", pa.int64()),  # the block's index
        pa.field("hook_name", pa.string()),  # the site in TransformerLens's names, as SAELens's cfg.json says it
        pa.field("architecture", pa.string()),  # topk | jumprelu
        pa.field("width", pa.int64()),  # latents
        pa.field("k", pa.int64()),  # topk's latents per position; null for jumprelu
        pa.field("d_in", pa.int64()),  # the site's width
        pa.field("steps", pa.int64()),
        pa.field("batch_tokens", pa.int64()),
        pa.field("train_positions", pa.int64()),  # activations trained on (the training windows' positions)
        pa.field("heldout_positions", pa.int64()),  # activations evaluated on
        pa.field("scale", pa.float64()),  # s: the dictionary reads s x (mean |s x| = sqrt(d_in) over the training set)
        pa.field("fvu", pa.float64()),  # sum |x - x_hat|^2 / sum |x - mean x|^2 over the held-out positions
        pa.field("mse", pa.float64()),  # the mean over held-out positions of |x - x_hat|^2 (the site's own units)
        pa.field("l0", pa.float64()),  # the mean number of latents with f > 0 per held-out position
        pa.field("dead", pa.int64()),  # latents that fire at no held-out position
        pa.field("dead_fraction", pa.float64()),
        pa.field("dense", pa.int64()),  # latents that fire at more than 10% of the held-out positions
        pa.field("dense_fraction", pa.float64()),
        pa.field("ce_clean", pa.float64()),  # the model's next-token CE (nats) on the held-out windows
        pa.field("ce_sae", pa.float64()),  # with the site replaced by the reconstruction (no error term)
        pa.field("ce_zero", pa.float64()),  # with the site replaced by zeros
        pa.field("ce_recovered", pa.float64()),  # (ce_zero - ce_sae) / (ce_zero - ce_clean); NaN where degenerate
        pa.field("degenerate", pa.bool_()),  # |ce_zero - ce_clean| < 1e-6: no recovered share
        pa.field("final_loss", pa.float64()),  # the training loss of the last step
        pa.field("train_seconds", pa.float64()),  # the training's wall time (not the collection's or evaluation's)
        pa.field("dictionary", pa.string()),  # its folder (SAELens's layout), relative to the run directory
    ],
    Presentation(keys=("site",), values=("fvu", "l0", "ce_recovered"), section=f"{SECTIONS}:evaluation_section"),
    classes=False,
)

STEPS = declare(
    STEPS_TABLE,  # one row per training step (the normalised activations' units)
    [
        pa.field("step", pa.int64()),
        pa.field("loss", pa.float64()),  # mse + the auxiliary term
        pa.field("mse", pa.float64()),  # the batch's mean |x' - x_hat'|^2 (x' = s x)
        pa.field("fvu", pa.float64()),  # the batch's sum |x' - x_hat'|^2 / sum |x' - its mean|^2
        pa.field("l0", pa.float64()),  # the batch's mean latents with f > 0 per position
        pa.field("aux_loss", pa.float64()),  # topk: AuxK (before its weight); jumprelu: the L0 term's L0
        pa.field("dead", pa.int64()),  # latents that have not fired for method.dead_steps steps
        pa.field("lr", pa.float64()),
    ],
    Presentation(section=f"{SECTIONS}:steps_section"),
    classes=False,
)

FEATURES = declare(
    FEATURES_TABLE,  # one row per latent, from the held-out windows (features.py)
    [
        pa.field("latent", pa.int64()),
        pa.field("density", pa.float64()),  # the share of the held-out positions at which it fires
        pa.field("mean_activation", pa.float32()),  # its mean f where it fires; NaN: dead
        pa.field("max_activation", pa.float32()),
        pa.field("dead", pa.bool_()),
        pa.field("dense", pa.bool_()),  # density above 0.1
        pa.field("top_activations", pa.list_(pa.float32())),  # its largest f, largest first
        pa.field("top_contexts", pa.list_(pa.string())),  # the text around each, the token marked «...»
        pa.field("top_windows", pa.list_(pa.string())),  # each one's window (its sample id)
        pa.field("top_positions", pa.list_(pa.int64())),  # and its position in the window (the BOS is 0)
        pa.field("promoted", pa.list_(pa.string())),  # the tokens of largest W_dec[i] @ W_U^T (no final norm)
        pa.field("promoted_logits", pa.list_(pa.float32())),
        pa.field("suppressed", pa.list_(pa.string())),  # the tokens of smallest W_dec[i] @ W_U^T
        pa.field("suppressed_logits", pa.list_(pa.float32())),
    ],
    Presentation(section=f"{SECTIONS}:features_section"),
    classes=False,
)

WINDOWS = declare(
    WINDOWS_TABLE,  # one row per window of the data: its part, and the held-out ones' losses
    [
        pa.field("split", pa.string()),  # train | held_out
        pa.field("positions", pa.int64()),  # the positions the dictionary reads (all but the BOS)
        pa.field("ce_clean", pa.float64()),  # held_out only: the mean CE of the window's predictions after the BOS
        pa.field("ce_sae", pa.float64()),
        pa.field("ce_zero", pa.float64()),
        pa.field("mse", pa.float64()),  # the mean |x - x_hat|^2 over the window's positions
        pa.field("l0", pa.float64()),
    ],
    Presentation(section=f"{SECTIONS}:windows_section"),
    classes=False,
)
