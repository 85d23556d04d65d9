# One GPU node: docker run --gpus 1 -p 8000:8000 -v /models/qwen-nvfp4:/weights vibeqwen --weights /weights
# (or `--weights demo` for the built-in tiny checkpoint on any machine).
# devel: nvcc builds csrc/ (the CUDA MoE decode kernel) on first start; the runtime image would fall back to Triton
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 VIBEQWEN_CACHE=/cache
WORKDIR /app
COPY pyproject.toml README.md ./
COPY vibeqwen ./vibeqwen
COPY kernels ./kernels
COPY configs ./configs
COPY csrc ./csrc
RUN pip install ".[gpu]" && useradd --create-home --uid 1000 vibeqwen && mkdir -p /cache && chown vibeqwen /cache
USER vibeqwen
EXPOSE 8000
ENTRYPOINT ["python", "-m", "vibeqwen", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--weights", "demo"]
