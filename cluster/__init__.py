"""Cluster plumbing: `ray up` configs (aws.yaml, gcp.yaml, onprem.yaml) and the local launcher
(`LocalCluster`: a local Ray plus a managed redis-server) that `pdserve up` uses."""

from cluster.local import LocalCluster, find_free_port, wait_for_redis

__all__ = ["LocalCluster", "find_free_port", "wait_for_redis"]
