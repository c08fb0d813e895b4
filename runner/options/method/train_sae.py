"""`method=train_sae`: a sparse autoencoder (TopK or JumpReLU) trained on a language model's activations at one site
over windows of text (data=text), evaluated on the held-out windows (reconstruction, sparsity, the language-model loss
with the site replaced by the reconstruction), its latents described as Neuronpedia describes them, and written in
SAELens's layout into the run directory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from runner.errors import RunnerError
from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig
from runner.site_kinds import SiteSelection

SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")  # the whole-width sites an SAE reads
ARCHITECTURES = ("topk", "jumprelu")
TABLES = ("train_sae", "train_sae_steps", "train_sae_features", "train_sae_windows")
LIGHT_STEPS = 20  # debug=light: training steps at most


@METHODS.option("runner.methods.train_sae.method:TrainSae", tables=TABLES, family=LM_FAMILY)
@dataclass
class TrainSaeConfig(MethodConfig):
    """The site read, the dictionary's architecture and size, and how it is trained (Adam, the run's seed). The run's
    `target` is not used."""

    name: str = "train_sae"
    site: str = "resid_post"  # resid_pre | resid_mid | resid_post | attn_out | mlp_out
    layer: int = 0  # the block whose site is read
    architecture: str = "topk"  # topk | jumprelu
    width: int = 512  # latents (SAELens's d_sae)
    k: Optional[int] = 32  # topk: latents kept per token  # noqa: UP045 (OmegaConf)
    # SAELens's defaults for jumprelu, on activations normalised to a mean norm of sqrt(d_in):
    l0_coefficient: float = 1.0  # jumprelu: the loss is |x - x_hat|^2 + l0_coefficient * L0
    bandwidth: float = 0.05  # jumprelu: the rectangle kernel's width in the L0's and threshold's pseudo-derivatives
    threshold_init: float = 0.01  # jumprelu: every latent's threshold at the start
    aux_coefficient: float = 0.03125  # topk: the weight of AuxK (Gao et al. 2024: dead latents predict the residual)
    dead_steps: int = 200  # training steps without firing that make a latent dead (AuxK trains the dead ones)
    steps: int = 1000  # Adam steps
    batch_tokens: int = 1024  # activations per step, drawn without replacement, a new order each pass
    lr: float = 0.001  # Adam's learning rate, decayed linearly to 0 over the last fifth of the steps
    contexts: int = 5  # top-activating held-out contexts kept per latent (the feature table)
    logit_tokens: int = 10  # tokens promoted and suppressed per latent (the feature table)

    def check(self) -> list[str]:
        if self.site not in SITES:
            raise RunnerError(f"method.site={self.site}: an SAE reads one of {', '.join(SITES)}.")
        if self.architecture not in ARCHITECTURES:
            raise RunnerError(
                f"method.architecture={self.architecture}: train_sae trains {' or '.join(ARCHITECTURES)}."
            )
        if self.architecture == "topk" and self.k is None:
            raise RunnerError("method.architecture=topk needs method.k, the latents kept per token (e.g. 32).")
        bad = super().check()
        positive = {"width": self.width, "steps": self.steps, "batch_tokens": self.batch_tokens,
                    "contexts": self.contexts, "logit_tokens": self.logit_tokens, "dead_steps": self.dead_steps}  # fmt: skip
        bad += [f"method.{key}={value}" for key, value in positive.items() if value < 1]
        if self.k is not None and not 1 <= self.k <= self.width:
            bad.append(f"method.k={self.k} (1 .. method.width={self.width})")
        floats = {"lr": self.lr, "bandwidth": self.bandwidth, "threshold_init": self.threshold_init}
        bad += [f"method.{key}={value}" for key, value in floats.items() if not value > 0]
        bad += [f"method.{key}={value}" for key, value in (("l0_coefficient", self.l0_coefficient),
                ("aux_coefficient", self.aux_coefficient)) if not value >= 0]  # fmt: skip
        if self.layer < 0:
            bad.append(f"method.layer={self.layer}")
        return bad

    def selection(self) -> SiteSelection:
        """The one site and layer read, marked by `runner layers` (the site's own check is `check`'s)."""
        return SiteSelection("method", (self.site,), (self.layer,))

    def lightened(self, layers: int) -> TrainSaeConfig:
        return dataclasses.replace(self, steps=min(self.steps, LIGHT_STEPS))
