"""E8M0 block scales in the tiled layout cuBLAS reads for MX products (torch._scaled_mm on SM100+).

cuBLAS takes the scales of an operand [rows, K] (one per 32 elements along K: a [rows, K/32]
matrix) in tiles of 128 rows x 4 scale columns, the matrix padded with zero bytes to whole tiles,
tiles stored row of tiles by row of tiles, and inside a tile the scale of (row r, column c) at
byte ``(r % 32) * 16 + (r // 32) * 4 + c`` (cuBLAS's "1D block scaling factors layout": the 128
rows as 4 interleaved groups of 32). `to_blocked` does it with one reshape and permute;
`to_blocked_reference` is the same rule written as the index formula, for the tests.
"""

from __future__ import annotations

import torch

TILE_ROWS, TILE_COLS = 128, 4


def _padded(scale: torch.Tensor) -> torch.Tensor:
    rows, cols = scale.shape
    pad_rows, pad_cols = -rows % TILE_ROWS, -cols % TILE_COLS
    raw = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    if pad_rows or pad_cols:
        raw = torch.nn.functional.pad(raw, (0, pad_cols, 0, pad_rows))
    return raw


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """[rows, K/32] scale bytes (uint8 or float8_e8m0fnu) -> the flat tiled layout (same dtype)."""
    raw = _padded(scale)
    tile_rows, tile_cols = raw.shape[0] // TILE_ROWS, raw.shape[1] // TILE_COLS
    # [tile row, r // 32, r % 32, tile col, c] -> [tile row, tile col, r % 32, r // 32, c]
    tiles = raw.reshape(tile_rows, 4, 32, tile_cols, TILE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(scale.dtype)


def to_blocked_reference(scale: torch.Tensor) -> torch.Tensor:
    """`to_blocked`, one byte at a time by the index formula (slow: for tests)."""
    raw = _padded(scale)
    tile_cols = raw.shape[1] // TILE_COLS
    out = torch.empty(raw.numel(), dtype=torch.uint8)
    for r in range(raw.shape[0]):
        for c in range(raw.shape[1]):
            tile = (r // TILE_ROWS) * tile_cols + c // TILE_COLS
            within = (r % 32) * 16 + ((r % TILE_ROWS) // 32) * 4 + c % TILE_COLS
            out[tile * TILE_ROWS * TILE_COLS + within] = raw[r, c]
    return out.view(scale.dtype)
