#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "table.h"
#include "words.h"

static int most_frequent_first(const void *a, const void *b)
{
    const struct entry *x = *(struct entry *const *)a;
    const struct entry *y = *(struct entry *const *)b;
    if (x->count != y->count)
        return x->count < y->count ? 1 : -1;
    return strcmp(x->word, y->word);
}

static int usage(void)
{
    fputs("usage: wordfreq [-n N] < text\n", stderr);
    return 2;
}

int main(int argc, char **argv)
{
    long top = 10;
    for (int i = 1; i < argc; i++) {
        char *end;
        if (strcmp(argv[i], "-n") != 0 || i + 1 >= argc)
            return usage();
        top = strtol(argv[++i], &end, 10);
        if (*argv[i] == '\0' || *end != '\0' || top < 0)
            return usage();
    }

    struct table t;
    char word[MAX_WORD];
    table_init(&t);
    while (next_word(stdin, word, sizeof word))
        table_add(&t, word);

    size_t n;
    struct entry **all = table_entries(&t, &n);
    qsort(all, n, sizeof *all, most_frequent_first);
    for (size_t i = 0; i < n && (top == 0 || (long)i < top); i++)
        printf("%7ld %s\n", all[i]->count, all[i]->word);
    free(all);
    table_free(&t);
    return 0;
}
