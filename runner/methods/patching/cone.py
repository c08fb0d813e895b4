"""Local recomputation of a patched cell through a chain of local modules (VGG16's `features`).

Patching one cell of a layer's map changes, in the next conv, only the outputs whose receptive
field touches the cell; the changed region grows by (k-1)/2 per 3x3 conv and halves at each pool.
When the patched layer sits in an `nn.Sequential` whose later children are all local (convolutions
and pools without dilation, element-wise activations, eval-mode batch norm), each variant is
carried through the chain as a crop: the window of input each op needs is cut from the base run's
activation, the variant's crop is laid over it, the op runs on the window alone, and the result is
the next crop. At the chain's end the crops are pasted into the base output, and the rest of the
model runs as usual. The arithmetic equals a full forward (the same ops on the same inputs);
its cost is that of the cone instead of the whole map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runner.hooks import inplace_disabled

ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Hardswish, nn.Sigmoid, nn.Tanh,
    nn.Identity, nn.Dropout, nn.BatchNorm2d,
)  # fmt: skip

Region = tuple[int, int, int, int]  # y0, y1, x0, x1 (ends exclusive)


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _plain(module: nn.Module, base: type[nn.Module], *methods: str) -> bool:
    """Whether `module` runs `base`'s own code: a subclass that overrides `forward` (or another of
    `methods`) may compute anything, so its geometry cannot be read from its attributes."""
    return all(getattr(type(module), m) is getattr(base, m) for m in ("forward", *methods))


def geometry(module: nn.Module) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None:
    """(kernel, stride, padding) per spatial dim of a local op, ((1,1),(1,1),(0,0)) if element-wise, else None.

    None also for a subclass that overrides the op's `forward` (e.g. a 'same'-padding conv), an op in
    training mode (dropout draws, batch norm uses the batch's statistics) and a batch norm without
    running statistics: their output at a position is not a function of a fixed window of the input.
    """
    if module.training:
        return None
    base = next((b for b in ELEMENTWISE if isinstance(module, b)), None)
    if base is not None:
        if not _plain(module, base):
            return None
        if isinstance(module, nn.BatchNorm2d) and (module.running_mean is None or module.running_var is None):
            return None
        return (1, 1), (1, 1), (0, 0)
    if isinstance(module, nn.Conv2d):
        if not _plain(module, nn.Conv2d, "_conv_forward"):
            return None
        if isinstance(module.padding, str) or module.padding_mode != "zeros" or _pair(module.dilation) != (1, 1):
            return None
        return _pair(module.kernel_size), _pair(module.stride), _pair(module.padding)
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        if not _plain(module, nn.MaxPool2d if isinstance(module, nn.MaxPool2d) else nn.AvgPool2d):
            return None
        if _pair(module.padding) != (0, 0) or module.ceil_mode or _pair(getattr(module, "dilation", 1)) != (1, 1):
            return None
        if isinstance(module, nn.MaxPool2d) and module.return_indices:
            return None
        if isinstance(module, nn.AvgPool2d) and module.divisor_override is not None:
            return None
        stride = module.stride if module.stride is not None else module.kernel_size
        return _pair(module.kernel_size), _pair(stride), (0, 0)
    return None


def _apply(module: nn.Module, window: torch.Tensor) -> torch.Tensor:
    """The op on an input window that already holds its padding (so no padding of its own)."""
    if isinstance(module, nn.Conv2d):
        return F.conv2d(window, module.weight, module.bias, module.stride, 0, 1, module.groups)
    if isinstance(module, nn.MaxPool2d):
        return F.max_pool2d(window, module.kernel_size, module.stride)
    if isinstance(module, nn.AvgPool2d):
        return F.avg_pool2d(window, module.kernel_size, module.stride)
    return module(window)


@dataclass
class Cone:
    """The local chain after a patched layer: the Sequential that holds it and the modules after it."""

    parent_name: str
    parent: nn.Module
    modules: list[nn.Module]

    @staticmethod
    def find(model: nn.Module, layer: str) -> Cone | None:
        """The chain after `layer` when its parent is a plain `nn.Sequential` of local ops after it, else None."""
        parent_name, _, child = layer.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if not isinstance(parent, nn.Sequential) or parent is model:
            return None
        # A subclass that overrides forward (`x + super().forward(x)`) is not the chain of its children:
        # the cone would paste the chain's output where the parent's own computation belongs.
        if not _plain(parent, nn.Sequential):
            return None
        names = list(parent._modules)
        after = [parent._modules[n] for n in names[names.index(child) + 1 :]]
        if not after or any(geometry(m) is None for m in after) or parent.training:
            return None
        return Cone(parent_name, parent, after)

    @torch.no_grad()
    def propagate(self, base: torch.Tensor, source: torch.Tensor, cells: list[Region]) -> torch.Tensor:
        """The chain's output (n, C', H', W') for each variant: `base` (C, H, W) with `source` in one cell."""
        with inplace_disabled(self.parent):
            inputs = [base[None]]
            for module in self.modules:  # the base run through the chain, batch 1
                inputs.append(module(inputs[-1]))
            h, w = base.shape[-2:]
            regions, crops = self._first_crops(base, source, cells, h, w)
            for module, base_in in zip(self.modules, inputs[:-1], strict=True):
                regions, crops = self._step(module, base_in, regions, crops)
            out = inputs[-1].expand(len(cells), *inputs[-1].shape[1:]).clone()
            for i, (y0, y1, x0, x1) in enumerate(regions):
                out[i, :, y0:y1, x0:x1] = crops[i]
        return out

    @staticmethod
    def _first_crops(base: torch.Tensor, source: torch.Tensor, cells: list[Region], h: int, w: int):
        """Crops of one size (the largest cell's), each holding its cell from `source` and base around it."""
        ch = max(y1 - y0 for y0, y1, _, _ in cells)
        cw = max(x1 - x0 for _, _, x0, x1 in cells)
        regions, crops = [], []
        for y0, y1, x0, x1 in cells:
            ey0, ex0 = min(y0, h - ch), min(x0, w - cw)
            crop = base[:, ey0 : ey0 + ch, ex0 : ex0 + cw].clone()
            crop[:, y0 - ey0 : y1 - ey0, x0 - ex0 : x1 - ex0] = source[:, y0:y1, x0:x1]
            regions.append((ey0, ey0 + ch, ex0, ex0 + cw))
            crops.append(crop)
        return regions, torch.stack(crops)

    @staticmethod
    def _step(module: nn.Module, base_in: torch.Tensor, regions: list[Region], crops: torch.Tensor):
        """One op on every variant's window: the new regions and crops (all of one size)."""
        (kh, kw), (sh, sw), (ph, pw) = geometry(module)  # type: ignore[misc]
        if (kh, kw, sh, sw) == (1, 1, 1, 1):
            return regions, _apply(module, crops)  # element-wise: the region stays, only the crop changes
        hin, win = base_in.shape[-2:]
        hout, wout = (hin + 2 * ph - kh) // sh + 1, (win + 2 * pw - kw) // sw + 1

        def span(r0: int, r1: int, k: int, s: int, p: int, size_out: int) -> tuple[int, int]:
            lo = max(0, -(-(r0 + p - k + 1) // s))  # first output whose window reaches r0
            hi = min(size_out, (r1 - 1 + p) // s + 1)  # one past the last output whose window reaches r1 - 1
            return lo, hi

        spans = [span(y0, y1, kh, sh, ph, hout) + span(x0, x1, kw, sw, pw, wout) for y0, y1, x0, x1 in regions]
        oh = max(b - a for a, b, _, _ in spans)
        ow = max(d - c for _, _, c, d in spans)
        padded = F.pad(base_in, (pw, pw, ph, ph))[0]  # (C, H+2p, W+2p): zero padding, as the conv's own
        windows, new_regions = [], []
        for (oy0, _, ox0, _), (y0, y1, x0, x1), crop in zip(spans, regions, crops, strict=True):
            oy0, ox0 = min(oy0, hout - oh), min(ox0, wout - ow)
            wy0, wx0 = oy0 * sh, ox0 * sw  # window origin in padded coordinates
            window = padded[:, wy0 : (oy0 + oh - 1) * sh + kh, wx0 : (ox0 + ow - 1) * sw + kw].clone()
            # lay the variant's crop over the window where they overlap (crop coords shifted by the padding)
            ay0, ay1 = max(y0 + ph, wy0), min(y1 + ph, wy0 + window.shape[1])
            ax0, ax1 = max(x0 + pw, wx0), min(x1 + pw, wx0 + window.shape[2])
            if ay0 < ay1 and ax0 < ax1:
                window[:, ay0 - wy0 : ay1 - wy0, ax0 - wx0 : ax1 - wx0] = crop[
                    :, ay0 - ph - y0 : ay1 - ph - y0, ax0 - pw - x0 : ax1 - pw - x0
                ]
            windows.append(window)
            new_regions.append((oy0, oy0 + oh, ox0, ox0 + ow))
        return new_regions, _apply(module, torch.stack(windows))
