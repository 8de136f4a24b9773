#!/usr/bin/env bash
# Regenerate the Python modules from kvstore.proto (needs grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. kvstore/proto/kvstore.proto
