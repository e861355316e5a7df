from adaptlm.cli import main

if __name__ == "__main__":  # not when a worker process (multiprocessing spawn) imports it as __mp_main__
    raise SystemExit(main())
