"""Review of the chain node's resource bounds: pending transactions the base fee overtook,
the memory of the recent blocks kept for the long polls, and the connections one client
may hold on the blob listener and the JSON-RPC port. Counted in transactions, bytes and
connections, never timed; each test fails on the node before its fix."""
import socket
import struct
import time

import pytest
from test_chain_review22 import burner, signed

from chain.devnet import dev_accounts
from chain.node import Node, NodeConfig

pytestmark = pytest.mark.timeout(300)


def in_process(data_dir, **options) -> Node:
    """A node whose blocks the test seals itself (``seal``), no producer thread."""
    return Node(NodeConfig(data_dir, block_time=0, decode_process=False, **options))


# --- a pending transaction the base fee overtook ----------------------------------------------

def test_a_transaction_the_base_fee_overtook_stays_pending_until_it_falls(tmp_path):
    """A pending transaction whose max fee a rising base fee overtook was dropped at the
    next seal: its sender's long poll saw it leave the pool and waited its whole timeout for
    a receipt that never came, and the sender's later nonces waited behind the gap for
    ever. As in geth it now stays pending, left out of blocks while the base fee is above
    it, and is mined once blocks below the target bring the base fee down again."""
    node = in_process(tmp_path / "data")
    try:
        filler, user = dev_accounts(2)
        base_fee = node.next_base_fee()
        node.admit(burner(filler, 0, node.head().gas_limit))  # a full block: the fee rises
        waiting = node.admit(signed(user, 0, maxFeePerGas=base_fee, maxPriorityFeePerGas=0))
        later = node.admit(signed(user, 1, maxFeePerGas=10**11))
        full = node.seal()
        assert [tx.hash for tx in full.transactions] != [] and node.next_base_fee() > base_fee
        overtaken = node.seal()  # the fee is above the user's max fee
        assert overtaken.transactions == ()
        assert waiting in node.mempool.by_hash and later in node.mempool.by_hash
        assert node.pending_nonce(bytes.fromhex(user.address[2:])) == 2
        assert node.next_base_fee() <= base_fee  # an empty block lowered it
        mined = node.seal()
        assert [tx.hash for tx in mined.transactions] == [waiting, later]
        assert len(node.mempool) == 0
    finally:
        node.stop()


# --- the recent blocks kept for the long polls ------------------------------------------------

def test_recent_blocks_are_bounded_by_bytes_and_evicted_ones_are_still_answered(tmp_path):
    """The sealed blocks kept in memory for the long polls were bounded by count only (64):
    64 blocks full of 128 KiB transactions held gigabytes. They are bounded by bytes too
    (the latest always kept); a block evicted from them is still answered, from the
    database, by eth_getTransactionReceipt and eth_getBlockByNumber, and the long poll's
    receipt lookup answers None for it (its client then asks eth_getTransactionReceipt),
    never a wrong one."""
    from chain.rpc import Rpc

    limit = 1 << 20
    node = in_process(tmp_path / "data", recent_bytes=limit)
    try:
        rpc = Rpc(node)
        account = dev_accounts(1)[0]
        data = b"\x01" * (120 << 10)
        gas = 21_000 + 40 * len(data)  # the calldata floor (EIP-7623)
        sealed = []
        for block in range(12):
            for nonce in (2 * block, 2 * block + 1):
                node.admit(signed(account, nonce, data=data, gas=gas))
            sealed.append(node.seal())
        kept = [node.recent[number][0] for number in node.recent]
        calldata = sum(len(tx.data) for block in kept for tx in block.transactions)
        assert kept[-1].hash == sealed[-1].hash and calldata <= limit
        evicted = sealed[0]
        assert evicted.number not in node.recent
        tx_hash = evicted.transactions[1].hash
        assert rpc.recent_receipt(tx_hash) is None
        receipt = rpc.handle({"jsonrpc": "2.0", "id": 1, "method": "eth_getTransactionReceipt",
                              "params": ["0x" + tx_hash.hex()]})["result"]
        assert (receipt["blockHash"], receipt["transactionIndex"], receipt["status"]) == (
            "0x" + evicted.hash.hex(), "0x1", "0x1")
        block = rpc.handle({"jsonrpc": "2.0", "id": 2, "method": "eth_getBlockByNumber",
                            "params": [hex(evicted.number), True]})["result"]
        assert [tx["input"] for tx in block["transactions"]] == ["0x" + data.hex()] * 2
        newest = sealed[-1].transactions[0].hash
        assert rpc.recent_receipt(newest)["blockHash"] == "0x" + sealed[-1].hash.hex()
    finally:
        node.stop()


# --- connections one client may hold ----------------------------------------------------------

UNKNOWN_BLOB = "/blobs/0x" + "00" * 32


def status_of(sock: socket.socket, path: str = UNKNOWN_BLOB) -> int:
    """The status of a HEAD request sent on `sock` (its reply has no body to read); 0 if
    the server reset the connection first (it refused it and closed)."""
    try:
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return read_status(sock)
    except (ConnectionResetError, BrokenPipeError):
        return 0


def read_status(sock: socket.socket) -> int:
    """The status of the reply the server sends on `sock`, its head read."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(4096)
        if not data:
            break
        head += data
    return int(head.split(b" ", 2)[1])


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(30)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def test_one_address_cannot_take_every_blob_connection(tmp_path):
    """The blob listener capped its connections in all (MAX_CONNECTIONS, a thread each) but
    not per client: one address opening them all left every other client refused. An
    address past MAX_CONNECTIONS_PER_ADDRESS is now answered 503; another address is still
    served, and the first is again once one of its connections closed."""
    from chain.blobs import BlobStore
    from chain.blobserver import MAX_CONNECTIONS_PER_ADDRESS, BlobServer

    opened = []
    with BlobServer(BlobStore(tmp_path / "blobs", 1 << 20)) as server:
        try:
            for _ in range(MAX_CONNECTIONS_PER_ADDRESS):
                opened.append(connect(server.port))
                assert status_of(opened[-1]) == 404  # served: counted by the listener
            extra = connect(server.port)
            opened.append(extra)
            assert read_status(extra) == 503  # unasked, as it opens
            other = connect(server.port, source="127.0.0.2")
            opened.append(other)
            assert status_of(other) == 404
            opened[0].close()
            statuses = []
            for _ in range(200):  # until the listener saw the close (bounded)
                retry = connect(server.port)
                statuses.append(status_of(retry))
                retry.close()
                if statuses[-1] not in (0, 503):
                    break
                time.sleep(0.01)
            assert statuses[-1] == 404
        finally:
            for sock in opened:
                sock.close()


def test_a_client_resetting_a_refused_connection_does_not_stop_the_blob_listener(tmp_path):
    """While the listener was full, a client that reset its connection before the 503
    was sent (SO_LINGER 0) made that send raise in the listener's accepting thread, which
    ended: no connection was accepted again until the node restarted. The refusal's send
    failing is now ignored."""
    from chain.blobs import BlobStore
    from chain.blobserver import MAX_CONNECTIONS, BlobServer

    opened = []
    with BlobServer(BlobStore(tmp_path / "blobs", 1 << 20)) as server:
        try:
            for i in range(MAX_CONNECTIONS):  # from two addresses: within either's share
                opened.append(connect(server.port, source=f"127.0.0.{1 + i % 2}"))
                assert status_of(opened[-1]) == 404
            for _ in range(500):  # each a race with the refusal's send: some lose it
                resetting = connect(server.port, source="127.0.0.3")
                resetting.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                     struct.pack("ii", 1, 0))
                resetting.close()
            refused = connect(server.port, "127.0.0.3")
            opened.append(refused)
            assert read_status(refused) == 503  # still answering
            for sock in opened:
                sock.close()
            statuses = []
            for _ in range(200):  # until the listener saw the closes (bounded)
                sock = connect(server.port, source="127.0.0.3")
                opened.append(sock)
                statuses.append(status_of(sock))
                if statuses[-1] not in (0, 503):
                    break
                time.sleep(0.01)
            assert statuses[-1] == 404
        finally:
            for sock in opened:
                sock.close()


def rpc_status(sock: socket.socket) -> int:
    """The status of an eth_blockNumber request sent on `sock` (its reply read whole)."""
    body = b'{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber","params":[]}'
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    reply = b""
    while b"\r\n\r\n" not in reply:
        data = sock.recv(4096)
        if not data:
            break
        reply += data
    head, _, rest = reply.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length and (data := sock.recv(4096)):
        rest += data
    return int(head.split(b" ", 2)[1])


def test_the_rpc_port_refuses_connections_past_its_bound_and_serves_the_others(tmp_path):
    """The node's JSON-RPC port took any number of connections (each a file descriptor:
    a client opening thousands ran the node out of them). `chain up --max-connections N`
    (1024 by default) answers 503 to a connection past N, or past N/2 from one address,
    as it opens, and serves the established ones on (uvicorn's limit_concurrency would
    have answered 503 to every request once N were open)."""
    from chain.launch import NodeProcess

    opened = []
    with NodeProcess(tmp_path / "data", block_time=0,
                     extra_args=("--max-connections", "4")) as proc:
        try:
            for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"):
                opened.append(connect(proc.port, source))
                assert rpc_status(opened[-1]) == 200
            opened.append(connect(proc.port, "127.0.0.1"))  # a third from one address
            assert read_status(opened[-1]) == 503  # unasked, as it opens
            opened.append(connect(proc.port, "127.0.0.3"))  # a fifth in all
            assert read_status(opened[-1]) == 503
            assert [rpc_status(sock) for sock in opened[:4]] == [200] * 4
        finally:
            for sock in opened:
                sock.close()


OUT_OF_FILES = """
import os, resource, sys
from chain.blobs import BlobStore
from chain.blobserver import BlobServer

server = BlobServer(BlobStore(sys.argv[1], 1 << 20)).start()
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64,
                                            resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print(server.port, flush=True)
sys.stdin.readline()  # a client connected meanwhile: its accept failed
for fd in held:
    os.close(fd)
print("freed", flush=True)
sys.stdin.read()
"""


def test_the_blob_listener_accepts_again_after_running_out_of_file_descriptors(tmp_path):
    """An accept that failed (EMFILE: the process out of file descriptors, which a client
    holding thousands of JSON-RPC connections brought about) ended the blob listener's
    accepting thread as if the listener had been closed: no blob connection was accepted
    again until the node restarted. It now retries."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", OUT_OF_FILES, str(tmp_path / "blobs")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        waiting = connect(port)  # accepted by the kernel, not by the listener: no fd left
        time.sleep(0.5)  # for the listener's accept to fail
        proc.stdin.write("free\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "freed\n"
        assert status_of(waiting) == 404
        waiting.close()
    finally:
        proc.kill()
        proc.wait()
