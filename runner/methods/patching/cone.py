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

The variants of a chunk move together: every crop of one step has one size, so the windows an op reads are
gathered from one flat buffer (the base run's map, a zero for the padding, the variants' crops) by an index
planned once per set of cells (`ConePlan`, on the device, reused for every sample). A step costs the same few
operations for 1 cell or 64: on a GPU, the kernel launches of a chunk do not grow with its cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
class Gather:
    """Where each pixel of a chunk's windows comes from, as a flat index into cat([map, zero, crops]):
    pixel (i, c, y, x) reads `position[i, 0, y, x] + channel[c] * stride[i, 0, y, x]`."""

    position: torch.Tensor  # (n, 1, h, w) int64: the pixel's place at channel 0
    stride: torch.Tensor  # (n, 1, h, w) int64: the channel stride of the part it reads (0 for the padding)
    channels: torch.Tensor  # (1, C, 1, 1) int64: arange(C)

    def take(self, buffer: torch.Tensor) -> torch.Tensor:
        """(n, C, h, w) the windows read from `buffer` (flat): one index op, one gather."""
        return buffer[torch.addcmul(self.position, self.stride, self.channels)]

    def to(self, device: torch.device) -> Gather:
        return Gather(self.position.to(device), self.stride.to(device), self.channels.to(device))


@dataclass
class ConePlan:
    """The index plan of one set of cells through the chain: the first crops, each windowed op's gather (None for
    an element-wise op), and the paste of the last crops into the chain's output."""

    first: Gather
    steps: list[Gather | None]
    paste: Gather
    regions: int  # cells


def _windows(
    regions: Sequence[Region], size: tuple[int, int], origins: Sequence[tuple[int, int]], map_hw: tuple[int, int],
    pad: tuple[int, int], channels: int, overlay: Sequence[Region], overlay_is_map: bool,
) -> Gather:  # fmt: skip
    """The gather of n windows of `size` at `origins` (padded coordinates) over a map (C, *map_hw) padded by `pad`,
    where variant i's `overlay[i]` (map coordinates) is read from the crops part instead of the map: from variant
    i's crop (channels x `regions[i]`'s size, laid at regions[i]) or, with `overlay_is_map`, from a second map.

    The buffer is cat([map.flatten(), zero, second.flatten()]): the map's C*H*W values, one zero (the padding),
    then the overlay's part (the n crops, or a second map of the map's shape)."""
    (h, w), (ph, pw), (wh, ww) = map_hw, pad, size
    n, hw = len(origins), h * w
    zero = channels * hw
    ys = np.arange(wh)[None, :, None] + np.array([o[0] for o in origins])[:, None, None] - ph  # (n, wh, 1) map rows
    xs = np.arange(ww)[None, None, :] + np.array([o[1] for o in origins])[:, None, None] - pw  # (n, 1, ww)
    inside = (ys >= 0) & (ys < h) & (xs >= 0) & (xs < w)  # (n, wh, ww)
    position = np.where(inside, ys * w + xs, zero)
    stride = np.where(inside, hw, 0)
    y0, y1, x0, x1 = (np.array([r[k] for r in overlay])[:, None, None] for k in range(4))
    over = (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)  # (n, wh, ww)
    if overlay_is_map:  # the second map, same shape as the first
        position = np.where(over, zero + 1 + ys * w + xs, position)
        stride = np.where(over, hw, stride)
    else:  # crop i holds regions[i]; its pixel (y, x) sits at (y - r.y0, x - r.x0)
        ry0, ry1, rx0, rx1 = (np.array([r[k] for r in regions])[:, None, None] for k in range(4))
        ch, cw = int((ry1 - ry0).max()), int((rx1 - rx0).max())
        crop = zero + 1 + np.arange(n)[:, None, None] * channels * ch * cw + (ys - ry0) * cw + (xs - rx0)
        position = np.where(over, crop, position)
        stride = np.where(over, ch * cw, stride)
    channel = torch.arange(channels).view(1, channels, 1, 1)
    return Gather(torch.from_numpy(position[:, None]).long(), torch.from_numpy(stride[:, None]).long(), channel)


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

    def plan(self, shapes: Sequence[tuple[int, ...]], cells: Sequence[Region], device: torch.device) -> ConePlan:
        """The index plan of `cells` through the chain, whose inputs have the shapes (C, H, W) `shapes` (the patched
        map's, then each module's output: the base run's), built on the host once and moved to `device`."""
        (c0, h, w) = shapes[0]
        ch = max(y1 - y0 for y0, y1, _, _ in cells)
        cw = max(x1 - x0 for _, _, x0, x1 in cells)
        # the first crops: one size (the largest cell's), each holding its cell from the source map, base around it
        origins = [(min(y0, h - ch), min(x0, w - cw)) for y0, _, x0, _ in cells]
        regions: list[Region] = [(oy, oy + ch, ox, ox + cw) for oy, ox in origins]
        first = _windows(regions, (ch, cw), origins, (h, w), (0, 0), c0, cells, overlay_is_map=True)
        steps: list[Gather | None] = []
        for module, shape in zip(self.modules, shapes[:-1], strict=True):
            (kh, kw), (sh, sw), (ph, pw) = geometry(module)  # type: ignore[misc]
            if (kh, kw, sh, sw) == (1, 1, 1, 1):
                steps.append(None)  # element-wise: the region stays, only the crop changes
                continue
            hin, win = shape[1:]
            hout, wout = (hin + 2 * ph - kh) // sh + 1, (win + 2 * pw - kw) // sw + 1
            spans = [_span(y0, y1, kh, sh, ph, hout) + _span(x0, x1, kw, sw, pw, wout) for y0, y1, x0, x1 in regions]
            oh = max(b - a for a, b, _, _ in spans)
            ow = max(d - c for _, _, c, d in spans)
            outs = [(min(oy0, hout - oh), min(ox0, wout - ow)) for oy0, _, ox0, _ in spans]
            window = ((oh - 1) * sh + kh, (ow - 1) * sw + kw)
            origins = [(oy * sh, ox * sw) for oy, ox in outs]  # in padded coordinates
            steps.append(_windows(regions, window, origins, (hin, win), (ph, pw), shape[0], regions, False))
            regions = [(oy, oy + oh, ox, ox + ow) for oy, ox in outs]
        c, h, w = shapes[-1]
        paste = _windows(regions, (h, w), [(0, 0)] * len(cells), (h, w), (0, 0), c, regions, overlay_is_map=False)
        moved = [None if g is None else g.to(device) for g in steps]
        return ConePlan(first.to(device), moved, paste.to(device), len(cells))

    def base_run(self, base: torch.Tensor) -> list[torch.Tensor]:
        """The base map (C, H, W) through the chain, batch 1: the input of each module, then the chain's output."""
        with inplace_disabled(self.parent):
            inputs = [base[None]]
            for module in self.modules:
                inputs.append(module(inputs[-1]))
        return inputs

    @torch.no_grad()
    def propagate(self, inputs: list[torch.Tensor], source: torch.Tensor, plan: ConePlan) -> torch.Tensor:
        """The chain's output (n, C', H', W') for each variant of `plan`: the base run `inputs` (`base_run`) with
        `source` (C, H, W) in the variant's cell. Each windowed op reads its input's dtype, as the model would."""
        zeros: dict[torch.dtype, torch.Tensor] = {}  # the padding's one zero, per dtype

        def buffer(base_map: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
            """cat([map, zero, rest]) flat, in the map's dtype: what a `Gather` reads."""
            zero = zeros.get(base_map.dtype)
            if zero is None:
                zero = zeros[base_map.dtype] = base_map.new_zeros(1)
            return torch.cat([base_map.reshape(-1), zero, rest.reshape(-1).to(base_map.dtype)])

        with inplace_disabled(self.parent):
            crops = plan.first.take(buffer(inputs[0], source))
            for module, step, base_in in zip(self.modules, plan.steps, inputs[:-1], strict=True):
                if step is not None:
                    crops = step.take(buffer(base_in, crops))
                crops = _apply(module, crops)
            return plan.paste.take(buffer(inputs[-1], crops))


def _span(r0: int, r1: int, k: int, s: int, p: int, size_out: int) -> tuple[int, int]:
    """The outputs [lo, hi) of an op (kernel k, stride s, padding p) whose window reaches input rows [r0, r1)."""
    lo = max(0, -(-(r0 + p - k + 1) // s))  # first output whose window reaches r0
    hi = min(size_out, (r1 - 1 + p) // s + 1)  # one past the last output whose window reaches r1 - 1
    return lo, hi
