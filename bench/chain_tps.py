"""Sustained signed submitJob transactions per second: needle-net's node vs stock py-evm.

Both routes execute the same Vyper ComputeMarket bytecode on py-evm's Prague rules and
receive the same kind of pre-signed EIP-1559 transactions:

- reference: web3.py's EthereumTesterProvider (eth-tester's PyEVMBackend, one block per
  transaction, in process, no HTTP);
- needle-net: a real `python -m chain up` process over HTTP, transactions sent as batched
  eth_sendRawTransaction requests, many transactions per block.

Also, in process: the CPU time of sealing blocks of submitJob transactions (Node.seal) with
needle-net's execution path (chain/interpreter.py, chain/flatstate.py) and with stock py-evm's.

Transactions are signed before the clock starts (signing is the client's cost). The rate is
transactions included in sealed blocks per second of wall time, from the first send to the
moment every sender's nonce is mined. Also reported: jobs per second through submitJobs
(many jobs per transaction).

    python bench/chain_tps.py [--txs 2000] [--reference-txs 200] [--senders 8] [--many-txs 64]
                              [--seal-blocks 3] [--seal-block-txs 480]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from eth_account import Account
from web3 import EthereumTesterProvider, Web3

from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.launch import NodeProcess
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID, MARKET_ADDRESS


def job_args(i: int) -> list:
    return [i.to_bytes(32, "big"), b"\1" * 32, 1, 64, 64, 64, 1, 100]


def sign_all(contract, accounts, per_sender: int, chain_id: int, base_fee_cap: int,
             fn: str = "submitJob", args_of=job_args, value: int = 10**12,
             gas: int = 300_000, first_nonce: int = 0) -> list[list[bytes]]:
    """Pre-signed transactions, one list per sender, per_sender of them from first_nonce."""
    signed = []
    for s, account in enumerate(accounts):
        mine = []
        for nonce in range(first_nonce, first_nonce + per_sender):
            data = contract.encode_abi(fn, args=args_of(s * per_sender + nonce))
            tx = {"to": contract.address, "data": data, "value": value, "gas": gas,
                  "maxFeePerGas": base_fee_cap, "maxPriorityFeePerGas": 1, "nonce": nonce,
                  "chainId": chain_id, "type": 2}
            mine.append(account.sign_transaction(tx).raw_transaction)
        signed.append(mine)
    return signed


def reference_rate(txs: int) -> tuple[float, float]:
    """eth-tester (stock py-evm, auto-mine: one block per transaction), in a child process
    with eth-hash's default keccak backend: importing `chain` here selects a faster one."""
    out = subprocess.run(
        [sys.executable, __file__, "--reference-only", str(txs)], check=True,
        capture_output=True, text=True, env={**os.environ, "ETH_HASH_BACKEND": "pycryptodome"},
    ).stdout
    wall, cpu = out.split()[-2:]
    return float(wall), float(cpu)


def stock_rate(txs: int) -> tuple[float, float]:
    w3 = Web3(EthereumTesterProvider())
    key = w3.provider.ethereum_tester.backend.account_keys[0]
    account = Account.from_key(key.to_bytes())
    market = compiled_market()
    deploy = {"data": "0x" + market["bytecode"].hex(), "gas": 5_000_000, "nonce": 0,
              "maxFeePerGas": 10**11, "maxPriorityFeePerGas": 1, "chainId": w3.eth.chain_id,
              "type": 2, "value": 0}
    receipt = w3.eth.wait_for_transaction_receipt(
        w3.eth.send_raw_transaction(account.sign_transaction(deploy).raw_transaction))
    contract = w3.eth.contract(address=receipt["contractAddress"], abi=market["abi"])
    (signed,) = sign_all(contract, [account], txs, w3.eth.chain_id, 10**11, first_nonce=1)
    start, cpu = time.perf_counter(), time.process_time()
    for raw in signed:
        w3.eth.send_raw_transaction(raw)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert contract.functions.jobCount().call() == txs
    return txs / elapsed, txs / cpu


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process and its live children (the node's
    transaction decoder), from Linux /proc."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if stat.parent.name == str(pid) or fields[1] == str(pid):
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def node_rate(url: str, pid: int, signed: list[list[bytes]], batch: int,
              senders_per_thread: int) -> tuple[float, float]:
    """Send every sender's transactions in batches from a few threads; wait until mined.
    Returns transactions per wall second and per CPU second of the node process."""
    w3 = Web3(Web3.HTTPProvider(url))
    addresses = [Account.recover_transaction(s[0]) for s in signed]
    start_nonces = [w3.eth.get_transaction_count(a) for a in addresses]
    groups = [signed[i:i + senders_per_thread] for i in range(0, len(signed),
                                                                 senders_per_thread)]
    errors: list = []

    def send(group):
        with httpx.Client(timeout=120) as http:
            longest = max(len(s) for s in group)
            for offset in range(0, longest, batch):
                chunk = [raw for sender in group for raw in sender[offset:offset + batch]]
                payload = [{"jsonrpc": "2.0", "id": i, "method": "eth_sendRawTransaction",
                            "params": ["0x" + raw.hex()]} for i, raw in enumerate(chunk)]
                replies = http.post(url, json=payload).json()
                errors.extend(r["error"] for r in replies if "error" in r)

    # a batch of junk starts the node's decoder process (a one-off start-up cost) before
    # the clock
    httpx.post(url, json=[{"jsonrpc": "2.0", "id": i, "method": "eth_sendRawTransaction",
                           "params": ["0x00"]} for i in range(batch)], timeout=120)
    start, cpu = time.perf_counter(), cpu_seconds(pid)
    threads = [threading.Thread(target=send, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} transactions rejected, first: {errors[0]}")
    targets = [n + len(s) for n, s in zip(start_nonces, signed, strict=True)]
    while any(w3.eth.get_transaction_count(a) < t for a, t in zip(addresses, targets,
                                                                    strict=True)):
        time.sleep(0.02)
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    total = sum(len(s) for s in signed)
    return total / elapsed, total / cpu


def seal_rates(market, accounts, per_block: int, blocks: int, fast: bool) -> list[float]:
    """submitJob transactions per CPU second of Node.seal, in process, block after block
    (admission not counted)."""
    per_sender = per_block // len(accounts)
    signed = sign_all(market, accounts, per_sender * blocks, CHAIN_ID, 10**11)
    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        node = Node(NodeConfig(Path(tmp) / "data", block_time=0, fast_execution=fast))
        try:
            for b in range(blocks):
                for raws in signed:
                    for raw in raws[b * per_sender:(b + 1) * per_sender]:
                        node.admit(bytes(raw))
                start = time.process_time()
                block = node.seal()
                rates.append(len(block.transactions) / (time.process_time() - start))
        finally:
            node.stop()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--txs", type=int, default=2000, help="submitJob txs into the node")
    parser.add_argument("--reference-txs", type=int, default=200,
                        help="submitJob txs through EthereumTesterProvider")
    parser.add_argument("--senders", type=int, default=8)
    parser.add_argument("--batch", type=int, default=100, help="txs per JSON-RPC batch")
    parser.add_argument("--jobs-per-tx", type=int, default=64, help="submitJobs batch size")
    parser.add_argument("--many-txs", type=int, default=64, help="submitJobs transactions")
    parser.add_argument("--seal-blocks", type=int, default=3, help="in-process sealed blocks")
    parser.add_argument("--seal-block-txs", type=int, default=480, help="txs per such block")
    parser.add_argument("--reference-only", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference_only is not None:
        print(*stock_rate(args.reference_only))
        return
    if args.reference_txs < 1:
        parser.error("--reference-txs must be at least 1: every rate is a ratio against it")
    if args.txs < args.senders:
        parser.error(f"--txs must be at least --senders ({args.senders}): each sends txs/senders")
    if args.seal_blocks and args.seal_block_txs < args.senders:
        parser.error(f"--seal-block-txs must be at least --senders ({args.senders})")

    print(f"machine: {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    print("rates: per wall-clock second / per CPU second of the process doing the work "
          "(the node, or the in-process tester)")
    ref, ref_cpu = reference_rate(args.reference_txs)
    print(f"reference  EthereumTesterProvider (1 block/tx): {ref:7.1f} / {ref_cpu:7.1f} "
          f"submitJob tx/s ({args.reference_txs} txs)")

    with tempfile.TemporaryDirectory() as tmp, \
            NodeProcess(Path(tmp) / "data", block_time=1.0) as node:
        pid = node.proc.pid
        market = Web3().eth.contract(address=Web3.to_checksum_address(MARKET_ADDRESS),
                                     abi=compiled_market()["abi"])
        accounts = dev_accounts(args.senders)
        per_sender = args.txs // args.senders
        signed = sign_all(market, accounts, per_sender, CHAIN_ID, 10**11)
        rate, rate_cpu = node_rate(node.url, pid, signed, args.batch,
                                   max(1, args.senders // 2))
        print(f"needle-net node over HTTP (batched blocks):     {rate:7.1f} / {rate_cpu:7.1f} "
              f"submitJob tx/s ({per_sender * args.senders} txs)   ratio {rate / ref:.1f}x / "
              f"{rate_cpu / ref_cpu:.1f}x")

        k = args.jobs_per_tx

        def many(i):
            return [[(i * k + j).to_bytes(32, "big") for j in range(k)], [b"\1" * 32] * k,
                    [1] * k, [64] * k, [64] * k, [64] * k, [1] * k, [10**12] * k, 100]

        txs = max(1, args.many_txs // args.senders)
        signed = sign_all(market, accounts, txs, CHAIN_ID, 10**11, fn="submitJobs",
                          args_of=many, value=10**12 * k, gas=60_000 * k + 100_000,
                          first_nonce=per_sender)
        txs *= args.senders
        many_rate, many_cpu = node_rate(node.url, pid, signed, args.batch,
                                        max(1, args.senders // 2))
        print(f"needle-net submitJobs ({k} jobs/tx):            {many_rate * k:7.1f} / "
              f"{many_cpu * k:7.1f} jobs/s ({txs} txs, {txs * k} jobs)   ratio "
              f"{many_rate * k / ref:.1f}x / {many_cpu * k / ref_cpu:.1f}x")

    if args.seal_blocks:
        market = Web3().eth.contract(address=Web3.to_checksum_address(MARKET_ADDRESS),
                                     abi=compiled_market()["abi"])
        fast, stock = (seal_rates(market, dev_accounts(args.senders), args.seal_block_txs,
                                  args.seal_blocks, fast) for fast in (True, False))
        print(f"sealing in process, blocks of {args.seal_block_txs} submitJob (tx per CPU "
              f"second of Node.seal, block by block): needle-net "
              f"{' '.join(f'{r:.0f}' for r in fast)}, stock py-evm execution "
              f"{' '.join(f'{r:.0f}' for r in stock)}   ratio "
              f"{sum(fast) / sum(stock):.1f}x")

if __name__ == "__main__":
    main()
