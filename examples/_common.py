"""Shared by the examples: reach a server (``--url``) or start the demo model in-process."""
from __future__ import annotations

import argparse
import contextlib
import os
from typing import Iterator


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--url",
                    help="a running `forkserve serve` (default: start the demo model here, on CPU)")
    ap.add_argument("--model", help="the model id to request (default: the server's base model)")
    ap.add_argument("--api-key", default=os.environ.get("FORKSERVE_API_KEY"),
                    help="the server's --api-key, if it has one (default: $FORKSERVE_API_KEY)")
    return ap


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(base url, model id)."""
    if args.url:
        import httpx
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        model = args.model or httpx.get(f"{args.url}/v1/models",
                                        headers=headers).json()["data"][0]["id"]
        yield args.url, model
        return
    from forkserve.backend.torch import find_smollm2_gguf
    from forkserve.config import app_config
    from forkserve.interfaces.server.launcher import serve_in_thread
    from forkserve.interfaces.server.served_model import load_served_model

    print("starting the demo model (SmolLM2-135M-Instruct, CPU) ...", flush=True)
    served = load_served_model(find_smollm2_gguf(),
                               config=app_config(num_pages=512, num_residual_pages=512),
                               device="cpu")
    with serve_in_thread(served) as running:
        yield running.url, args.model or served.name
