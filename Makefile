.PHONY: main test check bench
main:
	scripts/main.sh
test:
	scripts/test.sh
check:
	scripts/check.sh
bench:
	bench/run.sh
