.PHONY: main test bench
main:
	scripts/main.sh
test:
	scripts/test.sh
bench:
	bench/run.sh
