"""Fleet simulation: devices at random earlier versions pull the latest from a signed feed.

1. builds ``--versions`` versions laid out as the daemon publishes them (``versions/N/model``,
   ``patch-from-<N-1>.safetensors``): a synthetic bf16 model whose every float tensor changes in
   ``--density`` of its entries per version (what a sparse fold such as TIES or SAFE-Merge does);
2. builds the signed feed (``mergestream.feed.build``) in patch format 1 and in format 2 + zstd;
3. serves each on a loopback ``ThreadingHTTPServer`` and lets ``--devices`` simulated devices pull
   with the real agent (``mergestream.agent.pull``): each starts at a random version in
   ``[0, versions)`` (0 = a fresh device), installed as the agent would have left it;
4. prints, per format, the total bytes downloaded against every device downloading the full
   model, and writes ``bench/results/fleet.json``.

Run: ``.venv/bin/python bench/fleet.py [--versions 8 --devices 100 --density 0.05]``.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import recorded_path  # bench/ (the script's folder) is first on sys.path

from mergestream.agent.pull import pull
from mergestream.agent.slots import Device
from mergestream.daemon.store import Store
from mergestream.feed.build import build_feed
from mergestream.feed.keys import generate
from mergestream.patches import weights_sha256
from mergestream.patches.build import build_patch


def make_versions(root: Path, versions: int, density: float, hidden: int) -> Store:
    """``versions`` daemon-style versions of a small bf16 transformer-shaped model."""
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.{n}": torch.randn(hidden, hidden, generator=g).to(torch.bfloat16)
             for i in range(4) for n in ("q", "k", "v", "o")}
    model["embed"] = torch.randn(1000, hidden, generator=g).to(torch.bfloat16)
    store = Store(root)
    for n in range(1, versions + 1):
        if n > 1:
            for k, v in model.items():
                mask = torch.rand(v.shape, generator=g) < density
                model[k] = torch.where(mask, (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype), v)
        d = store.path(n) / "model"
        d.mkdir(parents=True)
        save_file(model, str(d / "model.safetensors"))
        (d / "config.json").write_text('{"model_type": "toy"}')
        if n > 1:
            build_patch(store.path(n - 1) / "model", d, store.path(n) / f"patch-from-{n - 1:06d}.safetensors",
                        source_version=str(n - 1), target_version=str(n))
        store.point_current(n)
    return store


def seed_device(device: Path, store: Store, version: int, trusted_root: Path) -> None:
    """A device that runs ``version`` (slot a, as the agent leaves it); 0: a fresh device."""
    dev = Device(device)
    dev.prepare()
    shutil.copyfile(trusted_root, dev.trusted_root)
    if version:
        shutil.copytree(store.path(version) / "model", dev.slot_dir("a"))
        dev.mark_slot("a", version, weights_sha256(dev.slot_dir("a")))
        dev.set_pointer("current", "a")


def simulate(store: Store, feed: Path, starts: list[int], work: Path) -> dict:
    """Serve ``feed`` on loopback and let one device per entry of ``starts`` pull the latest."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(feed))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    total, t0 = 0, time.perf_counter()
    try:
        for i, v in enumerate(starts):
            device = work / f"device-{i}"
            seed_device(device, store, v, feed / "metadata" / "1.root.json")
            total += pull(str(device), url)["bytes_downloaded"]
            shutil.rmtree(device)
    finally:
        httpd.shutdown()
        httpd.server_close()
    return {"bytes": total, "seconds": time.perf_counter() - t0}


def main() -> None:
    """Run the simulation and print one line per patch format."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fleet.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleet-"))
    try:
        store = make_versions(work / "state", args.versions, args.density, args.hidden)
        generate(work / "keys")
        starts = [random.Random(args.seed + i).randrange(args.versions) for i in range(args.devices)]
        rows = []
        for fmt, zstd in ((1, None), (2, 3)):
            feed = work / f"feed-{fmt}"
            rep = build_feed(store.root, feed, work / "keys", patch_format=fmt, zstd_level=zstd)
            sim = simulate(store, feed, starts, work)
            full = rep["full_model_bytes"] * args.devices
            row = {"patch_format": fmt, "zstd": zstd, "feed_bytes": rep["bytes"], "bytes_to_latest": rep["bytes_to_latest"],
                   "devices": args.devices, "fleet_bytes": sim["bytes"], "full_download_bytes": full,
                   "ratio": sim["bytes"] / full, "seconds": sim["seconds"]}
            rows.append(row)
            print(f"format {fmt}{'+zstd' if zstd else ''}: {args.devices} devices downloaded {sim['bytes']:,} bytes, "
                  f"{row['ratio']:.1%} of {full:,} for full downloads ({sim['seconds']:.1f} s); "
                  f"per version: {rep['bytes_to_latest']}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        recorded = {**vars(args), "out": recorded_path(args.out)}  # no host folder in the result
        Path(args.out).write_text(json.dumps({"args": recorded, "rows": rows}, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
