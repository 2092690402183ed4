#!/usr/bin/env bash
# Build the C++ DDP worker against the MLX that the mlx wheel ships (its include/ and libmlx).
#   examples/cpp_worker/build.sh [PYTHON] -> examples/cpp_worker/build/worker
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${1:-python3}
mlx=$("$python" -c 'import mlx, os; print(os.path.join(mlx.__path__[0]))')
mkdir -p "$here/build"
if [ "$here/build/worker" -nt "$here/worker.cpp" ] && [ "$here/build/worker" -nt "$(ls "$mlx"/lib/libmlx.* | head -1)" ]; then
  exit 0
fi
g++ -std=c++20 -O2 -I"$mlx/include" "$here/worker.cpp" -L"$mlx/lib" -lmlx -Wl,-rpath,"$mlx/lib" \
  -o "$here/build/worker.tmp"
mv "$here/build/worker.tmp" "$here/build/worker"
