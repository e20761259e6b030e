"""`python -m controlplane.lab.prepare_tests`: make sure the services the tests use answer."""

from __future__ import annotations

from controlplane.lab import backing


def main() -> None:
    print(f"tests use Postgres at {backing.lab_database_url().split('@')[-1]}", flush=True)
    print(f"tests use Redis at {backing.lab_redis_url()}", flush=True)


if __name__ == "__main__":
    main()
