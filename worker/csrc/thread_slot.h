/* A struct of its own for each thread that calls in: made (zeroed) on the thread's first call, kept
 * for its next calls, and handed to `destroy` when the thread exits, so that a thread that calls in
 * and goes away leaves nothing behind. THREAD_SLOT(name, Type, destroy) defines `Type *name_get(void)`,
 * which returns the calling thread's struct, or NULL where no key or memory could be had. */
#ifndef KVS_THREAD_SLOT_H
#define KVS_THREAD_SLOT_H
#include <pthread.h>
#include <stdlib.h>

#define THREAD_SLOT(name, Type, destroy)                                                                              \
    static pthread_key_t name##_key;                                                                                  \
    static int name##_key_ok;                                                                                         \
    static pthread_once_t name##_once = PTHREAD_ONCE_INIT;                                                            \
    static void name##_make_key(void) { name##_key_ok = pthread_key_create(&name##_key, destroy) == 0; }              \
    static Type *name##_get(void) {                                                                                   \
        pthread_once(&name##_once, name##_make_key);                                                                  \
        if (!name##_key_ok) return NULL;                                                                              \
        Type *p = pthread_getspecific(name##_key);                                                                    \
        if (p == NULL) {                                                                                              \
            if ((p = calloc(1, sizeof *p)) == NULL) return NULL;                                                      \
            if (pthread_setspecific(name##_key, p) != 0) {                                                            \
                free(p);                                                                                              \
                return NULL;                                                                                          \
            }                                                                                                         \
        }                                                                                                             \
        return p;                                                                                                     \
    }

#endif
