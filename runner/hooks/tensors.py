"""Tensor saving: the tensors `save_tensors` hooks keep, written to one safetensors sidecar file per batch."""

from __future__ import annotations

from pathlib import Path

import torch


class TensorSaver:
    """A batch's kept tensors, written to `directory/batch-<first sample index>.safetensors` at the batch's end."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory  # None: tensors are kept and named for the rows, but never written
        self.first_index = -1
        self._saved: dict[str, torch.Tensor] = {}

    def begin_batch(self, first_index: int) -> None:
        """Start a batch whose first sample has data set index `first_index` (it names the file)."""
        self.first_index = first_index
        self._saved.clear()

    @property
    def file_name(self) -> str:
        """The current batch's file name: keyed by its first sample, so an OOM split's halves get one each."""
        return f"batch-{self.first_index:06d}.safetensors"

    def keep(self, key: str, tensor: torch.Tensor) -> str:
        """Keep a copy of `tensor` under `key`; return the file it will be written to."""
        self._saved[key] = tensor.detach().clone()  # a clone: a later in-place op must not change it
        return self.file_name

    def flush(self) -> None:
        """Write the batch's kept tensors (when there is a directory and something was kept), then drop them."""
        if self.directory is not None and self._saved:
            self._write(self.directory / self.file_name)
        self._saved.clear()

    def clear(self) -> None:
        """Drop every kept tensor unwritten."""
        self._saved.clear()

    def _write(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous().cpu() for k, v in self._saved.items()}, str(tmp))
        tmp.replace(path)  # atomic: a killed run leaves no half file under the final name
