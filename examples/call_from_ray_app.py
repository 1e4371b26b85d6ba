"""Call a running lorafleet app from another Ray driver or Ray app, through a DeploymentHandle.

    serve run serve_config.yaml &          # or any cluster running the app
    python examples/call_from_ray_app.py   # RAY_ADDRESS=... for a remote cluster
"""

from __future__ import annotations

import sys

import ray
from ray import serve

from engine.request import GenerateRequest


def main(app_name: str = "lorafleet") -> None:
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    handle = serve.get_app_handle(app_name)

    # one completion with an adapter (the name travels inside the request object)
    result = handle.generate.remote(GenerateRequest(adapter="demo-1", prompt="Hello", max_tokens=8)).result()
    print(f"RESULT adapter={result.adapter} replica={result.replica_id} tokens={result.completion_tokens} "
          f"text={result.text!r}")

    # streaming: token deltas, then the final result with usage
    stream = handle.options(stream=True).generate_stream.remote(
        GenerateRequest(adapter=None, prompt="Hello", max_tokens=8))
    for item in stream:
        print("STREAM", getattr(item, "text", ""), getattr(item, "finish_reason", None))

    # the fleet registry, as the admin API shows it
    for entry in handle.list_adapters.remote().result()["data"]:
        print("ADAPTER", entry["name"], "resident on", entry["resident_on"])


if __name__ == "__main__":
    main(*sys.argv[1:])
