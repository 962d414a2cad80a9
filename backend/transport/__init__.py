"""KV transports: how prefill's bytes reach decode's page pool (one-sided writes).

``base.KvTransport`` is the interface; ``mooncake`` is the real one (TCP with P2P handshake on CPU
hosts, RDMA on clusters); ``loopback`` is a single-host TCP fallback for when Mooncake is not
installed; ``inprocess`` serves unit tests (both roles in one process).
"""
