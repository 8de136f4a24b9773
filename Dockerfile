# kvstore daemon, CLI and demo. CPU image; GPU users start from their own CUDA torch image.
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY kvstore kvstore
COPY kernels kernels
COPY tiers tiers
COPY server server
COPY client client
COPY benchmarks benchmarks
RUN pip install --no-cache-dir ".[engines]" tqdm matplotlib
EXPOSE 9400
CMD ["kvstore-server", "--data-dir", "/data", "--socket", "/run/kvstore/kv.sock"]
