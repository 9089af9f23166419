import os

import torch

# Two cores on CI: keep intra-op threads from oversubscribing the engine's loop and executor threads.
torch.set_num_threads(int(os.environ.get("MOE_TEST_THREADS", "2")))
