"""Read amplification: the bytes the workers' reader reads for every shard of a job, over the
input's size (1.0x: every byte read once).

python -m bench.read_once

Data shaped as tools write it: Parquet files of one 50,000-row row group each (pyarrow's
`write_table` defaults for files of that size), 256 float32 features a row, 200,000 rows;
shards of 10,000 rows asked. Bytes are what this process read from files while it read every
shard (`rchar` of /proc/self/io), footers included.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.common.job import InputSpec
from ebb.shard_master.planning.planner import plan_shards
from ebb.worker.shardio.reader import ShardReader

FILES = 4
ROWS_PER_FILE = 50_000
FEATURES = 256
ROWS_PER_SHARD = 10_000


def write_data(folder: Path) -> int:
    """The dataset; returns its size in bytes."""
    rng = np.random.default_rng(0)
    for f in range(FILES):
        x = rng.random((ROWS_PER_FILE, FEATURES), dtype=np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES)
        ids = np.arange(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE)
        pq.write_table(pa.table({"id": ids, "x": features}), folder / f"part-{f}.parquet")
    return sum(p.stat().st_size for p in folder.iterdir())


def bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ebb-read-once-") as tmp:
        folder = Path(tmp)
        size = write_data(folder)
        spec = InputSpec(uri=str(folder), format="parquet", rows_per_shard=ROWS_PER_SHARD)
        shards = plan_shards(spec)
        before = bytes_read()
        rows = 0
        for shard in shards:
            reader = ShardReader(shard, None)
            while (data := reader.next()) is not None:
                rows += data.table.num_rows
        read = bytes_read() - before
    print(
        f"{len(shards)} shards, {rows:,} rows; input {size / 1e6:.1f} MB, read "
        f"{read / 1e6:.1f} MB: read amplification {read / size:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
