"""asyncio support: `await transfer` waits for it on a worker thread (the wait releases the
GIL), so the event loop keeps running."""

import asyncio


async def wait(transfer, timeout=None):
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, transfer.wait, timeout)
    return transfer
