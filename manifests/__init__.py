"""KubeRay manifests and their renderer (`python -m manifests.render`); see manifests/README.md."""
