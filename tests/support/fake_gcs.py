"""Ray's GCS as ``omni_patches.proof`` reads it (``collect_ray`` / ``prune_ray``), over a dict; the real GCS is
in tests/test_ray_cluster.py."""
import json

from omni_patches import proof


class FakeCluster:
    """The GCS calls collect_ray / prune_ray make: the KV store of records, and the node, job and actor tables."""

    address = "127.0.0.1:6379"

    def __init__(self, records, nodes, jobs, actors):
        self.kv = {proof.kv_key(r).encode(): json.dumps(r).encode() for r in records}
        self._nodes, self._jobs, self._actors = nodes, jobs, actors
        self.deleted = []

    def keys(self):
        return list(self.kv)

    def get(self, keys):
        return {k: self.kv[k] for k in keys if k in self.kv}

    def delete(self, key):
        self.deleted.append(key)
        self.kv.pop(key, None)

    def nodes(self):
        return self._nodes

    def jobs(self):
        return self._jobs

    def actors(self):
        return self._actors


def ray_record(pid, node, actor, *, job="01000000", boot="other-boot", instance="I", rank=None, updated=1000.0):
    """A Ray worker's record as the KV store holds it (on nodes N1 = 127.0.0.1 and N2 = 127.0.0.2)."""
    return {"pid": pid, "instance": instance, "boot_id": boot, "updated": updated, "started": updated - 1,
            "role": f"ray worker {rank}" if rank is not None else "ray worker", "rank": rank,
            "patches": {"p": {"state": "applied"}},
            "ray": {"node_id": node, "node_ip": {"N1": "127.0.0.1", "N2": "127.0.0.2"}.get(node), "job_id": job,
                    "actor_id": actor}}
