"""Root test configuration, loaded before any test module.

Triton reads TRITON_INTERPRET when it is first imported, so it is set here: without a GPU, every Triton
kernel in the test session runs in the interpreter (CPU). With CUDA present, kernels run compiled.
"""

import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests run gRPC servers (OTLP receivers) in this process and fork service processes: gRPC's fork handlers
# must stay off, or a child forked while gRPC's poller runs may abort. Read when grpc is first imported.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Gateways started by tests (README commands, launcher tests) keep their Batch API store under the state
# directory: a temporary one, not the user's ~/.local/state.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="spindle-test-state-")
