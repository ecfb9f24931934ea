"""Deployment: Kubernetes manifests (k8s/), nginx (nginx/) and local replicas behind it (cluster.py)."""
