#ifndef WORDS_H
#define WORDS_H

#include <stddef.h>
#include <stdio.h>

/* The longest word kept whole (longer ones are cut). */
#define MAX_WORD 64

/* Reads the next word of `in` into `buf` (NUL-terminated, cut at size - 1
   bytes).  Returns 0 at the end of the input, 1 otherwise. */
int next_word(FILE *in, char *buf, size_t size);

#endif
